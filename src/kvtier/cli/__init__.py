"""The `kvtier` command (`main`): one module per subcommand (`config`, `vllm` for `serve` and
`vllm`, `simulate`, `bench`, `inspect`, `demo` with its `demo_report`), and `output` (progress,
and engine logs kept off the terminal)."""
