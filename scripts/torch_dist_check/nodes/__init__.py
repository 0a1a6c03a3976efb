"""Stand-in nodes on one host (``--nodes N``): each a network namespace with its own address (namespaces),
and the delay line that degrades a node's link where netem cannot (delayline)."""
