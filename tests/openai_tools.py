"""A function tool shared by the SDK tests of tools and structured outputs."""

from __future__ import annotations

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER_PARAMETERS},
}
