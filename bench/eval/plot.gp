# Attention loss (mean over steps, layers and heads) against the KV memory a
# policy really kept (mean resident tokens per layer over the decode, as a
# fraction of the context: snapkv keeps its budget plus every decoded
# token; bound: the per-step floor at budget + 1 tokens), one panel per workload family, one line per policy (points: the
# 12.5/25/50/75% budgets): from kvkeep-eval's eval.csv. Run by bench/eval.sh:
#   gnuplot -e "csv='results/eval.csv'; png='results/quality.png'" plot.gp
if (!exists("csv")) csv = 'eval.csv'
if (!exists("png")) png = 'quality.png'
families = "sinks locality heavy_hitters needle_repeated needle_once head_types mixed"
policies = "window streaming_llm h2o tova scissorhands snapkv h2o_page oracle bound"
# Every policy its own colour and its own marker (gnuplot's default cycle
# has 8 colours: the 9th line would repeat the first).
colours = "#1f77b4 #d62728 #2ca02c #ff7f0e #9467bd #8c564b #e377c2 #17becf #000000"
markers = "7 5 9 11 13 4 6 8 10"
set terminal pngcairo size 1800,900 font ",10" noenhanced
set output png
set datafile separator ","
set multiplot layout 2,4 title "Attention loss (mean) vs resident KV (mean, fraction of the context); lower is better"
set xrange [0:1]
set yrange [0:1]
set xtics 0.25
set grid
set key off
do for [f = 1:words(families)] {
  fam = word(families, f)
  set title fam
  plot for [p = 1:words(policies)] \
    sprintf("< awk -F, '$1==\"%s\" && $2==\"%s\"' %s", fam, word(policies, p), csv) \
    using ($15 / ($4 / $3)):5 with linespoints lw 2 lc rgb word(colours, p) \
    pt int(word(markers, p)) ps 0.9 title word(policies, p)
}
# The last panel: the legend.
set key center center box
unset border; unset tics; unset grid; unset title
set xrange [0:1]; set yrange [0:1]
plot for [p = 1:words(policies)] NaN with linespoints lw 2 \
  lc rgb word(colours, p) pt int(word(markers, p)) title word(policies, p)
unset multiplot
