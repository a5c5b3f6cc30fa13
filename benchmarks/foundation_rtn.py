"""Foundation benchmark: RTN schemes on SmolLM2-135M against the unquantized model, house protocol.

    python benchmarks/foundation_rtn.py [--text wikitext2|PATH] [--max-windows 40]
        [--out benchmarks/results/foundation_rtn.json]

Writes the JSON records and prints the Markdown table that docs/RESULTS.md quotes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from llmeasyquant import CompareSpec, compare, parse_scheme
from llmeasyquant.record import write_records
from llmeasyquant.report.tables import markdown_table

SCHEMES = (
    "w8a16,w8a8,w8a8-aasym,w8a16-asym,w8a16-g128,w4a16-g64-asym,w4a16-g128-asym,w4a16-g64,w4a16-g32-asym,w3a16-g64-asym"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--text", default="wikitext2", help="evaluation text (default: the shipped WikiText-2 test)")
    parser.add_argument("--schemes", default=SCHEMES)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/foundation_rtn.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    schemes = [parse_scheme(s) for s in args.schemes.split(",")]
    records = compare(CompareSpec("smollm2-135m", schemes, "rtn", text=args.text, seqlen=args.seqlen,
                                  max_windows=args.max_windows))
    write_records(args.out, records)
    print(markdown_table([r.metrics for r in records]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
