"""The labelled step dataset (docs/design.md §11): step records, splits and a datasheet."""
