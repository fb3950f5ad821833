"""`TorchDDPPlugin`: PyTorch DDP, every rank a full replica."""

from cx_plugins.ddp._plugin import TorchDDPPlugin

__all__ = ["TorchDDPPlugin"]
