"""Texts shipped inside the package, by name, so that evaluation and calibration work offline on a fresh install.

`--text wikitext2` reads the WikiText-2 raw test split and `--calib wikitext2` the validation split, from the files
beside this module (see wikitext2/README.md for their source and licence). `pyref` is a second domain: the topics of
the Python Language Reference (technical prose and code; pyref/README.md), for checking that a result tuned on
WikiText-2 holds on other text. Each file's sha256 is checked on every
read: it is the identity that result records carry, so a changed file must fail rather than give other figures.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from typing import Literal

from llmeasyquant.errors import DataError

Split = Literal["test", "validation"]


@dataclass(frozen=True)
class ShippedFile:
    file: str  # path below this package
    sha256: str
    label: str  # the data set and split, e.g. "WikiText-2 raw test"

    @property
    def description(self) -> str:
        """What result records and tables name as the text source."""
        return f"{self.label} (shipped {self.file.rsplit('/', 1)[-1]})"


# name -> split -> file. The validation split is WikiText-2's tokenized release: the file every calibrated result in
# docs/RESULTS.md was calibrated on (its rare words read `<unk>`).
SHIPPED: dict[str, dict[str, ShippedFile]] = {
    "wikitext2": {
        "test": ShippedFile("wikitext2/wiki.test.raw",
                            "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c",
                            "WikiText-2 raw test"),
        "validation": ShippedFile("wikitext2/valid.txt",
                                  "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
                                  "WikiText-2 validation"),
    },
    "pyref": {
        "test": ShippedFile("pyref/reference.test.txt",
                            "70cce85193e572a8c8f3e19668657793cdab762c5d45603687d2c288325188a2",
                            "Python Language Reference topics, test half"),
        "validation": ShippedFile("pyref/reference.valid.txt",
                                  "5570c04edd96ae8057c5259878166d8c61a5ccdf826a8fa27662db574109de94",
                                  "Python Language Reference topics, validation half"),
    },
}
ALIASES = {"wikitext2": "wikitext2", "wikitext-2": "wikitext2", "wikitext": "wikitext2", "pyref": "pyref",
           "python-reference": "pyref"}

# The sha256 of every shipped evaluation split: calibrating on one of them would flatter every result.
EVALUATION_SHA256 = {f.sha256: f.label for splits in SHIPPED.values() for s, f in splits.items() if s == "test"}


def is_shipped(name: str) -> bool:
    return name.lower() in ALIASES


def shipped_names() -> list[str]:
    return sorted(SHIPPED)


def shipped_bytes(name: str, split: Split) -> tuple[bytes, ShippedFile]:
    """The bytes of a shipped text and its table entry; DataError for an unknown name or a changed file."""
    key = ALIASES.get(name.lower())
    if key is None:
        raise DataError(f"no shipped text is named {name!r}; shipped: {', '.join(shipped_names())}")
    entry = SHIPPED[key].get(split)
    if entry is None:
        raise DataError(f"the shipped text {key} has no {split} split; it has {', '.join(SHIPPED[key])}")
    resource = resources.files(__package__).joinpath(entry.file)
    try:
        data = resource.read_bytes()
    except OSError as exc:
        raise DataError(f"the shipped file {entry.file} is missing from the llmeasyquant package ({exc}); "
                        "reinstall the package") from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise DataError(f"the shipped file {entry.file} has sha256 {digest[:12]}…, not {entry.sha256[:12]}…: its "
                        "bytes were changed (line ends converted by git?); restore it with `git checkout -- "
                        f"src/llmeasyquant/texts/{entry.file}` or reinstall the package")
    return data, entry
