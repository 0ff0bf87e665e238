"""A branch source in one file (`tests/test_sources.py` registers it in one line): it proposes, under the root, the
continuation that followed the last occurrence of the root token earlier in the text, one token deep."""

from __future__ import annotations

import math


class EchoSource:
    name = "echo"  # its phase in a profile
    flag = "echo"  # names the nodes only it proposed: `DraftTree.flags["echo"]`

    def __init__(self):
        self.asked = 0

    def propose(self, history):
        """`(parent, token, log step probability)` nodes for the text `history` (1-D, the root last)."""
        self.asked += 1
        tokens = history.tolist()
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == tokens[-1]:
                return [(-1, tokens[i + 1], math.log(0.9))]
        return []
