"""Constraints the structured-output tests share: a nested schema (object, array, enum, pattern,
bounds), a regex and a choice list."""
from __future__ import annotations

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "role", "address"]}
REGEX = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "maybe"]
