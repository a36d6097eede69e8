"""The public face: flash_attn_func and flash_attn_varlen_func (interface), the torch custom
ops (ops), attention_autograd (autograd), the Blackwell kernels by name (sm100) and FA4's private
_flash_attn_fwd/_flash_attn_bwd with register_sdpa, for PyTorch's SDPA (sdpa)."""
