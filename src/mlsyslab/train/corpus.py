"""A real text corpus with no download: the documentation of Python's standard library.

The docstrings of a fixed list of standard-library modules, their classes and functions (about
330 kB of English technical prose, ~86k SmolLM2 tokens on Python 3.11), in a fixed order: every run on the same Python version reads
the same text. Tokenised with a real tokenizer (SmolLM2's, from the installed GGUF) into one long
stream of token ids.
"""

import importlib
import inspect
import sys
from pathlib import Path

import torch

MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "io", "ipaddress", "itertools",
    "json", "logging", "math", "multiprocessing", "operator", "os", "pathlib", "pickle", "queue", "random", "re",
    "sched", "secrets", "selectors", "shutil", "socket", "sqlite3", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zipfile", "zlib",
)


def stdlib_text() -> str:
    """The docstrings of MODULES and of their public members, separated by blank lines."""
    pieces = []
    for name in MODULES:
        module = importlib.import_module(name)
        pieces.append(inspect.getdoc(module) or "")
        for member_name in sorted(vars(module)):
            member = vars(module)[member_name]
            if member_name.startswith("_") or not (inspect.isclass(member) or inspect.isroutine(member)):
                continue
            if getattr(member, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(member)
            if doc:
                pieces.append(f"{member_name}: {doc}")
    return "\n\n".join(p for p in pieces if p)


def corpus_tokens(cache_dir: Path) -> torch.Tensor:
    """The corpus as SmolLM2 token ids (int64), tokenised once and cached per Python version."""
    from mlsyslab.nn.pretrained import resolve_folder
    from mlsyslab.nn.tokenizer import Tokenizer

    path = Path(cache_dir) / f"stdlib-docs-py{sys.version_info.major}{sys.version_info.minor}-smollm2.pt"
    if path.is_file():
        return torch.load(path)
    tokenizer = Tokenizer(resolve_folder("default"))
    tokens = torch.tensor(tokenizer.encode(stdlib_text()), dtype=torch.long)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(tokens, path)
    return tokens


def tokenizer_vocab() -> int:
    """Ids the corpus's tokenizer can produce, added tokens included (`len(AutoTokenizer)`, without its
    ~5 s of import and load on every `mlsys train`)."""
    from mlsyslab.nn.pretrained import resolve_folder
    from mlsyslab.nn.tokenizer import Tokenizer

    return Tokenizer(resolve_folder("default")).vocab_size
