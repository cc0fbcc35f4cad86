"""Data stage: trace records in, static packed training arrays out."""
