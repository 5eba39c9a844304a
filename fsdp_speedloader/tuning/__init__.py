"""The one-shot tuner: trial steps on a throw-away model (trial.py), the linear memory model (fit.py), the plan
(plan.py), and ``tune`` that runs the trials and returns the plan (tuner.py)."""
