"""The gangd node daemon."""
