"""A demo tool set for the tool server (tests, drills): ``calc`` and a document reader whose reads carry receipts.

    python -m gyms.server --tools gyms.demo_tools:DemoTools --options '{"n_docs": 100}'
"""

from __future__ import annotations

from gyms.service import ToolOutput
from gyms.tools import CALC_TOOL, Tool, ToolError
from gyms.trace import Receipt, sha256_text


class DemoTools:
    """``calc`` plus ``read(doc_id)`` over ``n_docs`` generated documents ``doc-0`` .. ``doc-{n-1}``."""

    def __init__(self, n_docs: int = 100, seed: int = 0) -> None:
        self.docs = {f"doc-{i}": f"doc-{i}: item {i} has value {(i * 7919 + seed * 104729) % 1000}"
                     for i in range(n_docs)}

    def receipt(self, doc_id: str) -> Receipt:
        text = self.docs[doc_id]
        return Receipt(record_hash=sha256_text(f"{doc_id}\n{text}"), payload_digest=sha256_text(text), revision=1)

    def read(self, doc_id: str) -> ToolOutput:
        if doc_id not in self.docs:
            raise ToolError(f"no document {doc_id[:32]!r}")
        return ToolOutput(self.docs[doc_id], receipts=(self.receipt(doc_id),))

    def server_tools(self) -> list[Tool]:
        read = Tool(name="read", description="Read a document by id.",
                    parameters={"type": "object", "properties": {"doc_id": {"type": "string"}},
                                "required": ["doc_id"]},
                    fn=self.read)
        return [CALC_TOOL, read]
