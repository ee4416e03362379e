// make slides: every slide of every deck laid out in headless Chromium (marp's bare template,
// all slides on one page), and each one measured, as a projector shows it. A slide fails when
// an element's box reaches outside the slide's 1280x720 box or into its footer (the footer's
// top, or the bottom padding on a slide without one), when a code or output block is wider
// than its box (its lines would be cut), or when code is set below MIN_CODE_PX, too small to
// read from the back of a room. Exits 1 naming the deck, the slide and the element.
//   node slides/check-render.mjs build/slides/bare/NN_name.html ...
import puppeteer from "puppeteer-core";
import path from "node:path";

const SLACK = 1;  // px: sub-pixel rounding of the layout, nothing more
const MIN_CODE_PX = 20;  // code blocks and inline code, in the slide's own pixels
const browser = await puppeteer.launch({
  executablePath: process.env.CHROME_PATH || "/usr/bin/chromium",
  args: ["--no-sandbox", "--allow-file-access-from-files"],
});
let problems = 0, slides = 0;
try {
  const page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 720 });
  for (const file of process.argv.slice(2)) {
    const deck = path.basename(file, ".html");
    await page.goto("file://" + path.resolve(file), { waitUntil: "load" });
    const broken = await page.evaluate(() =>
      [...document.images].filter((i) => !i.complete || i.naturalWidth === 0).map((i) => i.src));
    for (const src of broken) {
      console.error(`error: slides/${deck}.md: image ${src} did not load`);
      problems++;
    }
    const found = await page.evaluate((slack, minCode) => {
      const out = [];
      const sections = [...document.querySelectorAll("svg[data-marpit-svg] > foreignObject > section")]
        .filter((s) => !["background", "pseudo"].includes(s.dataset.marpitAdvancedBackground));
      sections.forEach((section, i) => {
        const box = section.getBoundingClientRect();
        const scale = box.width / 1280;  // the SVG scales the slide to the page
        const footer = section.querySelector(":scope > footer");
        const footerTop = footer && footer.textContent.trim()
          ? footer.getBoundingClientRect().top
          : box.bottom - parseFloat(getComputedStyle(section).paddingBottom) * scale;
        // inside an absolutely positioned box (or that box itself): not in the slide's flow
        const positioned = (el, top) => {
          for (let e = el; e && e !== top; e = e.parentElement)
            if (getComputedStyle(e).position === "absolute") return true;
          return false;
        };
        const name = (el) => {
          const text = (el.textContent || "").trim().replace(/\s+/g, " ").slice(0, 50);
          return `<${el.tagName.toLowerCase()}> "${text}"`;
        };
        for (const el of section.querySelectorAll("*")) {
          const r = el.getBoundingClientRect();
          if (r.width === 0 && r.height === 0) continue;
          if (positioned(el, section)) continue;  // header, footer, KaTeX's hidden MathML
          const math = el.closest(".katex");      // a formula is measured as a whole: KaTeX
          if (math && math !== el) continue;      // draws \sqrt with a clipped, very wide SVG
          const below = (r.bottom - box.bottom) / scale, above = (box.top - r.top) / scale;
          const right = (r.right - box.right) / scale;
          if (below > slack || above > slack || right > slack) {
            out.push({ slide: i + 1, what: `${name(el)} reaches ${Math.round(Math.max(below, above, right))} px outside the slide` });
            break;  // one message per slide: its first overflowing element
          }
          const into = (r.bottom - footerTop) / scale;
          if (into > slack) {
            out.push({ slide: i + 1, what: `${name(el)} reaches ${Math.round(into)} px into the footer` });
            break;
          }
        }
        for (const el of section.querySelectorAll("pre, code")) {
          const px = parseFloat(getComputedStyle(el).fontSize);
          if (px < minCode - 0.01) {
            out.push({ slide: i + 1, what: `${name(el)} is set at ${px.toFixed(1)} px, below the ${minCode} px code needs on a projector` });
            break;
          }
        }
        for (const pre of section.querySelectorAll("pre")) {
          if (pre.scrollWidth > pre.clientWidth + slack)
            out.push({ slide: i + 1, what: `a code block's lines are ${pre.scrollWidth - pre.clientWidth} px wider than the block: ${name(pre)}` });
        }
      });
      return { count: sections.length, out };
    }, SLACK, MIN_CODE_PX);
    slides += found.count;
    for (const p of found.out) {
      console.error(`error: slides/${deck}.md: slide ${p.slide}: ${p.what}`);
      problems++;
    }
  }
} finally {
  await browser.close();
}
console.log(`render check: ${slides} slides in ${process.argv.length - 2} decks, ${problems} problems`);
process.exit(problems ? 1 : 0);
