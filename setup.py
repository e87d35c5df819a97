from setuptools import Extension, setup

# llmsim/sim/_allocator.c: the caching-allocator model compiled (llmsim/sim/allocator.py is the reference and the fallback
# where no C compiler is found: `optional`).
setup(ext_modules=[Extension("llmsim.sim._allocator", ["llmsim/sim/_allocator.c"], optional=True,
                             extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers"])])
