"""The `cx-train` demo: a language model (cx's reference GPT, a tiny transformers preset or a local transformers
model folder) trained on embedded text with any cx plugin on N local processes."""

from cx_plugins.demo._cli import main
from cx_plugins.demo._data import CharTokenizer, GrammarText, TextEncoder, TokenWindows
from cx_plugins.demo._options import DemoOptions, parse_options

__all__ = ["CharTokenizer", "DemoOptions", "GrammarText", "TextEncoder", "TokenWindows", "main", "parse_options"]
