"""Where results go: crash-safe part files, atomic final output, resume plans and the output lock."""
