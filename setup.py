"""Everything is declared in pyproject.toml; this file only installs ``hvtrace-autotrace.pth``
(the start-up hook of tracing by environment, :mod:`hvtrace_boot`) beside the packages, in a
wheel as in an editable install: setuptools has no declarative way to place a file at the root
of site-packages. And it names the parts that ``hvtrace/record/_hot.c`` includes as the compiled
hot path's ``depends``, so that a change to one of them rebuilds it (``setup.py build_ext
--inplace`` as ``pip install -e .``): pyproject.toml's extension names its sources only."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

PTH = "hvtrace-autotrace.pth"
#: The compiled hot path (pyproject.toml's ``hvtrace.record._hot``) and the parts its one C
#: source includes (hvtrace/record/_hot/*.c, *.h: one translation unit).
HOT_EXT = "hvtrace.record._hot"
HOT_PARTS = sorted(
    p.as_posix() for p in Path(__file__).parent.joinpath("hvtrace/record/_hot").glob("*.[ch]")
)


class BuildPyWithPth(build_py):
    """``build_py`` that also puts the ``.pth`` at the root of the wheel (so of site-packages)."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib, PTH)), preserve_mode=0)


class BuildExtWithParts(build_ext):
    """``build_ext`` that rebuilds the compiled hot path when one of its included parts changed."""

    def build_extension(self, ext) -> None:
        if ext.name == HOT_EXT:
            ext.depends = sorted({*ext.depends, *HOT_PARTS})
        super().build_extension(ext)


cmdclass = {"build_py": BuildPyWithPth, "build_ext": BuildExtWithParts}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    pass
else:

    class EditableWheelWithPth(editable_wheel):
        """``pip install -e``: the editable wheel carries the ``.pth`` too."""

        def _create_wheel_file(self, bdist_wheel):
            wheel_path = super()._create_wheel_file(bdist_wheel)
            from wheel.wheelfile import WheelFile

            with WheelFile(wheel_path, "a") as wheel:
                wheel.write(PTH, PTH)
            return wheel_path

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
