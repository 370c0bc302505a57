"""Provenance and supply chain: model signatures (OpenSSF model signing, key-based, offline) and the SBOM of the
installed environment (CycloneDX)."""
