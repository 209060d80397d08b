"""Redis servers for the tests (single and a 3-node cluster), started on free loopback ports."""
