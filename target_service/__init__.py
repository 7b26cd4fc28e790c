"""Target service: prefill, tree verify in one forward, commit of the accepted path, release."""
