"""Run folders: their files (catalog: find, list, show, cancel, plot), the runner that starts
a recipe child and watches it, the child itself, progress from the folder's files."""
