"""WAN emulation for tests and benchmarks (Linux, root): hosts in network namespaces joined by
veth pairs through router namespaces, each router shaping with `tc tbf` and delaying packets with
a userspace delay line on a TUN device (this kernel has no netem). Uses only the standard library
and iproute2; nothing in btnode's runtime depends on it."""
