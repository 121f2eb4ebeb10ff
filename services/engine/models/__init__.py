"""Model definitions and weight loading."""
