"""The one-shot tuner: trial steps on a throw-away model (trial.py) and the linear memory model and plan
(tuner.py)."""
