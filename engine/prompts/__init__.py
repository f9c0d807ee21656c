"""Prompts: chat messages to tokens (where only the template's markers are special), tools and
structured (JSON) output. Pure: what the model reads and how its reply is read back."""
