"""C++ CPU kernels registered as XLA FFI targets: built on first use, see `build`."""
