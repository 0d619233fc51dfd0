// Each output figure becomes a link to its image, so that a tap on a phone (or a click) opens it at full
// size, where the reader can zoom; book/_static/reader.css styles the link.
document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("div.cell_output img").forEach((img) => {
    if (img.closest("a")) return;
    const link = document.createElement("a");
    link.href = img.getAttribute("src");
    link.className = "figure-zoom";
    link.title = "Open the figure at full size";
    img.parentNode.insertBefore(link, img);
    link.appendChild(img);
  });
});
