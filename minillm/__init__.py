"""minillm: an educational LLM inference engine in pure PyTorch."""
