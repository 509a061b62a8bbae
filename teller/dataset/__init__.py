"""The labelled step dataset (DESIGN.md §11): step records, splits and a datasheet."""
