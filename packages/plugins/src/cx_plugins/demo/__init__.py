"""The `cx-train` demo: a reference GPT trained on embedded text with any cx plugin on N local processes."""

from cx_plugins.demo._cli import main
from cx_plugins.demo._data import CharTokenizer, GrammarText, TokenWindows
from cx_plugins.demo._options import DemoOptions, parse_options

__all__ = ["CharTokenizer", "DemoOptions", "GrammarText", "TokenWindows", "main", "parse_options"]
