"""``cmf.numba_cache``: every cached pycmf kernel is stamped with the whole package's numba
sources, so a change to a callee in another file recompiles its callers (numba alone stamps a
kernel with its own file, and an unchanged caller kept a changed callee's old code)."""

from __future__ import annotations

import importlib
import pkgutil

import numba
import pytest

import cmf
from cmf import numba_cache

OPTIONAL = ("cmf.integrations",)  # modules that need extras (vllm, torch) are skipped if absent


def _cached_dispatchers() -> list:
    found = []
    for info in pkgutil.walk_packages(cmf.__path__, "cmf."):
        if info.name.startswith(OPTIONAL) or info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an extra that is not installed
            continue
        for value in vars(module).values():
            if isinstance(value, numba.core.dispatcher.Dispatcher) and value.__module__ == info.name:
                cache = getattr(value, "_cache", None)
                if cache is not None and hasattr(cache, "_impl"):
                    found.append(value)
    return found


def test_every_cached_kernel_carries_the_package_stamp() -> None:
    dispatchers = _cached_dispatchers()
    assert len(dispatchers) > 100  # the kernels, the runtime's ops, the codecs' decoders, calibration
    for d in dispatchers:
        locator = d._cache._impl._locator
        assert type(locator).__name__ == "PackageStampedLocator", d.__module__ + "." + d.__name__
        stamp = locator.get_source_stamp()
        assert stamp[1] == numba_cache.package_fingerprint() and stamp[0]  # numba's own file stamp kept


def test_the_fingerprint_follows_numba_sources_only(tmp_path, monkeypatch) -> None:
    (tmp_path / "a.py").write_text("import numba\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("import numba  # b\n")
    (tmp_path / "c.py").write_text("x = 1\n")
    monkeypatch.setattr(numba_cache, "_ROOT", tmp_path)

    def fresh() -> str:
        monkeypatch.setattr(numba_cache, "_fingerprint", None)
        return numba_cache.package_fingerprint()

    first = fresh()
    assert fresh() == first
    (tmp_path / "c.py").write_text("x = 2\n")  # no numba in it: no effect
    assert fresh() == first
    (tmp_path / "sub" / "b.py").write_text("import numba  # b, changed\n")
    second = fresh()
    assert second != first
    for knob in numba_cache.KNOBS:  # a setting that changes compiled code is in the stamp too
        monkeypatch.setenv(knob, "ladder")
        assert fresh() != second
        monkeypatch.delenv(knob)
        assert fresh() == second


def test_functions_outside_the_package_keep_numbas_locators(tmp_path) -> None:
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    ours = impl._locator_classes[0]
    assert ours.__name__ == "PackageStampedLocator" and numba_cache.install()  # installed once
    assert sum(c.__name__ == "PackageStampedLocator" for c in impl._locator_classes) == 1
    outside = tmp_path / "m.py"
    outside.write_text("def f():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("m_outside", outside)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert ours.from_function(module.f, str(outside)) is None


@pytest.mark.parametrize("name", ["cmf.kernels.q4", "cmf.runtime.ops.decode"])
def test_the_cache_folder_is_numbas_own(name) -> None:
    """The wrapper changes the stamp, not where numba keeps the files."""
    module = importlib.import_module(name)
    d = next(v for v in vars(module).values()
             if isinstance(v, numba.core.dispatcher.Dispatcher) and hasattr(v._cache, "_impl"))
    locator = d._cache._impl._locator
    assert locator.get_cache_path() == locator._inner.get_cache_path()
    assert locator.get_disambiguator() == locator._inner.get_disambiguator()
