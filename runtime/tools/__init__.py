"""Tools that do real work for the ``lmc`` commands, which only parse and
print: the kernel lab, the benchmarks and load generator, the profile,
memory-plan, graph and model-file reports, and rendering pictures."""
