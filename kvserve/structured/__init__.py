"""Structured output: constraints compiled to grammars (grammar.py), their token masks (masks.py), and tool
calls in each model family's format (tool_calls.py)."""
