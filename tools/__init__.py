"""Developer tools of memplan (Python): front ends that export graphs."""
