"""Stage package."""
