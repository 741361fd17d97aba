# The phase banner that scripts/run.sh and scripts/test.sh share (sourced, not run). Set PHASES
# (how many phases the script announces) before the first `phase`.
#   phase N "title" "what it does and how long"   a numbered heading; the last phase's duration first
#   since T0                                      "XmYYs" since the epoch seconds T0
#   about SECONDS                                 "about N s" or "about N minutes"
since() { local s=$(( $(date +%s) - $1 )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
phase_start=0
phase() {
  [ "$phase_start" -gt 0 ] && echo "    (took $(since "$phase_start"))"
  phase_start=$(date +%s)
  printf '\n== %s/%s %s\n' "$1" "$PHASES" "$2"
  [ -n "${3:-}" ] && echo "$3" | fold -s -w 96 | sed 's/ *$//; s/^/   /'
  return 0
}
about() { if [ "$1" -lt 90 ]; then echo "about $(( ($1 + 4) / 5 * 5 )) s"; else echo "about $(( ($1 + 30) / 60 )) minutes"; fi; }
