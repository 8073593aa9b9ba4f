"""Model layer: checkpoint loading and the decoder's forward pass."""

from inferd.model.llama import LlamaForCausalLM
from inferd.model.loader import Checkpoint, load_checkpoint

__all__ = ["Checkpoint", "LlamaForCausalLM", "load_checkpoint"]
