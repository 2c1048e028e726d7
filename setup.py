"""Build the Cython kernels in pyx/ as private extension modules of seqpack.

``pyx/`` mirrors the package: ``pyx/LAYER/_NAME.pyx`` becomes ``seqpack.LAYER._NAME``
(and ``pyx/_NAME.pyx`` ``seqpack._NAME``). ``SEQPACK_CYTHON_DEBUG=1`` turns
bounds, wraparound and initialization checks on (with debug symbols), so an
out-of-range index in a kernel raises instead of reading garbage. That build stays at
-O2: at -O0 and -O1 GCC ends no AVX function with ``vzeroupper``, and the portable
attention path run after an AVX one took about 60 times as long. OpenMP is used
when the compiler accepts ``-fopenmp``; otherwise the kernels build single-threaded.
``SEQPACK_BUILD_ONLY=_a,_b`` (a kernel developer's shortcut) builds only those modules.
"""

import os
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
DEBUG = os.environ.get("SEQPACK_CYTHON_DEBUG", "") not in ("", "0")
OPENMP_FLAG = "-fopenmp"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": False,
    "embedsignature": True,
}


class OptionalOpenMPBuild(build_ext):
    """Compile with OpenMP where the compiler supports it, else warn and drop it.

    The modules compile in parallel, one per CPU, unless ``-j``/``--parallel`` says otherwise.
    """

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        # A switch between debug and optimized builds must recompile: the old
        # .so files are newer than the other mode's C sources.
        marker = Path(self.build_temp) / "seqpack-build-mode"
        mode = "debug" if DEBUG else "optimized"
        if not marker.exists() or marker.read_text() != mode:
            self.force = True
        if not self._compiler_accepts_openmp():
            warnings.warn("OpenMP is unavailable: seqpack kernels will run single-threaded")
            for ext in self.extensions:
                ext.extra_compile_args = [a for a in ext.extra_compile_args if a != OPENMP_FLAG]
                ext.extra_link_args = [a for a in ext.extra_link_args if a != OPENMP_FLAG]
        super().build_extensions()
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(mode)

    def _compiler_accepts_openmp(self):
        if sys.platform == "win32":
            return False
        source = textwrap.dedent(
            """
            #include <omp.h>
            int main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }
            """
        )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "probe.c"
            path.write_text(source)
            try:
                objects = self.compiler.compile(
                    [str(path)], output_dir=tmp, extra_postargs=[OPENMP_FLAG]
                )
                self.compiler.link_executable(
                    objects, "probe", output_dir=tmp, extra_postargs=[OPENMP_FLAG]
                )
            except Exception:  # any compiler or linker failure means no OpenMP
                return False
        return True


def extensions():
    # No contraction of a * b + c into one fused instruction: every CPU path of a kernel
    # (and every compiler default) then rounds the same way, so results are bitwise equal.
    compile_args = (["-O2", "-g"] if DEBUG else ["-O3"]) + ["-ffp-contract=off"]
    modules = []
    only = {name for name in os.environ.get("SEQPACK_BUILD_ONLY", "").split(",") if name}
    for source in sorted((HERE / "pyx").glob("**/*.pyx")):
        if only and source.stem not in only:
            continue
        package = ".".join(("seqpack",) + source.relative_to(HERE / "pyx").parent.parts)
        modules.append(
            Extension(
                f"{package}.{source.stem}",
                [str(source.relative_to(HERE))],
                extra_compile_args=compile_args + [OPENMP_FLAG],
                extra_link_args=[OPENMP_FLAG],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                # The C beside each module (pyx/LAYER/_NAME.h) and the shared headers (pyx/_*.h).
                include_dirs=["pyx", str(source.parent.relative_to(HERE))],
            )
        )
    return cythonize(
        modules,
        compiler_directives=DIRECTIVES,
        include_path=[str(HERE / "pyx")],
        # Separate C output per mode: a debug build never reuses optimized C, nor the reverse.
        build_dir=str(Path("build") / ("cython-debug" if DEBUG else "cython")),
    )


setup(
    package_dir={"": "src", "seqpack.fixtures": "fixtures"},
    packages=find_packages("src") + ["seqpack.fixtures"],
    package_data={"seqpack.fixtures": ["*.json"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalOpenMPBuild},
    zip_safe=False,
)
