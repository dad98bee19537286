"""The cluster on a local Ray instance."""
