from setuptools import Extension, setup

# llmsim/_allocator.c: the caching-allocator model compiled (llmsim/allocator.py is the reference and the fallback
# where no C compiler is found: `optional`).
setup(ext_modules=[Extension("llmsim._allocator", ["llmsim/_allocator.c"], optional=True,
                             extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers"])])
