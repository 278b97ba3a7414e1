"""The pure allocation core: no I/O, no clocks, no third-party imports."""
