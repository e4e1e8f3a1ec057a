"""Suite-wide pytest hooks."""

from __future__ import annotations

# The longest test files, started first: with one worker per core (scripts/test.sh runs
# pytest-xdist with --dist loadfile) a long file handed out last keeps one worker busy after the
# others have finished. Measured on 2 cores with a cold numba cache: test_real_model.py ~3.5 min
# of the suite's ~11 serial minutes, the next ones ~1 min each.
FIRST = ("test_real_model.py", "test_server.py", "test_compiling.py", "test_fast_paths.py", "test_specialize.py")


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's types
    """Move the longest files' tests to the front, each file's own order kept."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # a stable sort
