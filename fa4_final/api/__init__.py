"""The public face: flash_attn_func and flash_attn_varlen_func (interface), the torch custom
ops (ops), attention_autograd (autograd) and the Blackwell kernels by name (sm100)."""
