"""One module per CLI command; each parses, calls one library function and renders the result."""
