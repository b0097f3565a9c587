"""What people use: the `rawinfer` command line (cli/), the ZeroMQ server and client (server/), the
benchmarks (bench/), and the option groups they share (options.py)."""
