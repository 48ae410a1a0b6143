"""Everything is declared in pyproject.toml; this file only installs ``hvtrace-autotrace.pth``
(the start-up hook of tracing by environment, :mod:`hvtrace_boot`) beside the packages, in a
wheel as in an editable install: setuptools has no declarative way to place a file at the root
of site-packages."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hvtrace-autotrace.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also puts the ``.pth`` at the root of the wheel (so of site-packages)."""

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib, PTH)), preserve_mode=0)


cmdclass = {"build_py": BuildPyWithPth}

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
