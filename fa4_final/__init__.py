"""The finished FlashAttention-4 style kernel as a package with a PyTorch API.

Built in chapter 12; until then this package is empty on purpose (no stand-in API). It will
stand alone: it imports neither ``utils`` nor ``solutions``.
"""
