"""Plain-text tables, the one layout every recship printout uses (plans, quantization reports, inspect)."""

from typing import Sequence


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], center_headers: bool = False) -> str:
    """``headers`` and ``rows`` in columns joined by " | ", a dashed rule under the header.

    center_headers: TorchRec's sharding-plan layout (headers centred, every cell padded);
    otherwise headers are left-aligned and trailing spaces trimmed.
    """
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    head = " | ".join(h.center(w) if center_headers else h.ljust(w) for h, w in zip(headers, widths))
    body = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines = [head, " | ".join("-" * w for w in widths)] + body
    return "\n".join(lines if center_headers else [line.rstrip() for line in lines])
