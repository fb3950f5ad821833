"""fp8 helpers every plugin shares: `use_fp8`'s Linear conversion and the one-rank `fp8_communication` warning."""

from cx_plugins.fp8._communication import warn_if_nothing_to_compress
from cx_plugins.fp8._use_fp8 import check_fp8_recipe, convert_linears_to_fp8, warn_nothing_converted

__all__ = ["check_fp8_recipe", "convert_linears_to_fp8", "warn_if_nothing_to_compress", "warn_nothing_converted"]
