"""One line of a .jsonl file: the text in one field of a JSON object. Training's text reader (``data.py``), the
prepare tool (``prepare_inputs.py``) and generation's prompt files (``generate.py``) read lines this way, so a bad
line is refused in the same words everywhere; each caller names its own setting and where the line is."""

from __future__ import annotations

import json


class JsonLineError(ValueError):
    """What is wrong with a line; ``about_field``: the line is JSON, its text field is not there or not a string
    (the caller names the setting of the field, else of the file)."""

    def __init__(self, problem: str, *, about_field: bool) -> None:
        super().__init__(problem)
        self.about_field = about_field


def json_kind(value: object) -> str:
    """What a parsed JSON value is, as an error names it: 'a number', 'an array', 'null' ..."""
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def json_line_text(line: bytes | str, text_field: str, *, field_hint: str) -> str:
    """The string in ``text_field`` of the JSON object on ``line``; else ``JsonLineError``. ``field_hint`` ends
    the message of a missing field: how to name another one."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonLineError(f"not UTF-8 ({e.reason} at byte {e.start + 1} of the line); re-encode the file as "
                                "UTF-8", about_field=False) from None
    try:
        record = json.loads(line)
    except ValueError as e:
        raise JsonLineError(f"not valid JSON ({e})", about_field=False) from None
    if not isinstance(record, dict) or text_field not in record:
        found = sorted(record) if isinstance(record, dict) else json_kind(record)
        raise JsonLineError(f"no field {text_field!r} (found {found}); {field_hint}", about_field=True)
    text = record[text_field]
    if not isinstance(text, str):
        raise JsonLineError(f"field {text_field!r} holds {json_kind(text)}, not a string", about_field=True)
    return text
