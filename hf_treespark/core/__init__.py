"""The algorithm's core, torch only: the tree policy, expanding and packing a candidate tree (`tree`), the tree
attention mask and positions, the acceptance walk and the cache commit (`verify`), prepacked CPU linears
(`cpu_gemm`), the near-tie check (`exactness`).

Imports: torch and transformers only; nothing else of the package.
"""
