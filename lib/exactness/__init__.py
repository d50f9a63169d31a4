"""exactness: exactness receipts of LLM inference paths on a reference Mixture-of-Experts transformer.

Data flows one way: config -> weights -> kernels -> model -> paths -> analysis -> receipt -> notebooks.
"""
__version__ = "0.1.0"
