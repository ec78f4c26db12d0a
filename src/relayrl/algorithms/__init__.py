"""algorithms."""
